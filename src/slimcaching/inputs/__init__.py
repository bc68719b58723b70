"""What the planner reads: units, size limits, strict file I/O, model presets and checkpoint
directories, activation profiles and the routing records they are imported from, and the
generators of scenario data. Nothing here knows the resolved system or any algorithm."""
