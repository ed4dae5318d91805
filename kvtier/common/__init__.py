"""What every kvtier package uses and none owns: the counters' declarations (`counters`), a log
line once per cause (`once`), sizes and their units (`units`). Imports nothing of kvtier."""
