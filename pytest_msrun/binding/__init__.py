"""CPU / NUMA binding: flag parsing, topology discovery and placement strategies."""
