"""Weight updates from a trainer into a running engine (the staged protocol comes with the
weight-update issue)."""
