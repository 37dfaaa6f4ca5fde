"""Process-wide state with one owner each: glibc's malloc settings, torch optimizer hooks, torch.compile guards."""
