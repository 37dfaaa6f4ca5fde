"""Blocks read by rows: the embedding fetched row by row and the vocabulary-tiled LM head."""
