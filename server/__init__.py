"""specserve.server — see design.md §2; filled in by its own issue."""
