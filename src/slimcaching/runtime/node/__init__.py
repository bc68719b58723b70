"""A node (edge server or cloud): its server, start-up and command line, compute, admission,
step forwarding, live re-layout, split-style host and metrics."""
