"""The single controller (issue 6): batch assembly and the staleness bound so far."""
