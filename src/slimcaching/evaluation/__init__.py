"""What a placement achieves: latency breakdowns, token-level and queueing simulation, one-line
reports, profile statistics and the figures' common style."""
