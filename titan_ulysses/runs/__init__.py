"""A run's own folders: what the dump folder holds and the locks that keep two runs out of one."""
