"""A job's state on disk, outside the trainer's own checkpoint format: which checkpoints are
complete (``files``: written and fsynced, kept until the next one is named) and the resume
point a restarted job's ranks read to find where to start (``resume``). Pure logic: json,
os and fcntl only."""
