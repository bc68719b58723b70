"""Running a cluster: launching and reaping node processes, operator requests, whole runs with
their per-token report, adaptive re-placement and calibration."""
