"""A checkpoint on disk: the manifest, its data files, pieces, verified reads and writes, atomic directories."""
