"""Where things live and how they move: mesh, rules table, ZeRO strategies, multi-process."""
