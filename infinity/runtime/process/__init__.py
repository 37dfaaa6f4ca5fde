"""Process-wide state with one owner each: glibc's malloc settings, torch optimizer hooks,
torch.compile guards; and the process's peak RSS against the host budget's promise."""
