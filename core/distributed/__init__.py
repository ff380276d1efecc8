"""Workers and the executors that drive them (uni: in-process; mp: a process per rank)."""
