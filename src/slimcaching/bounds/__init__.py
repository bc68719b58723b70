"""Certificates: lower bounds on the optimal latency (storage, capacity levels, the Lagrangian over
the servers' contents, the LP) under one time budget, and :func:`~slimcaching.bounds.certificate.certify`."""
