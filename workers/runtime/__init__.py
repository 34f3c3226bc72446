"""A rank as a process: the runner, the rank, the local supervisor, the HTTP endpoint."""
