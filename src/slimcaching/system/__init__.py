"""The system being planned: the resolved scenario (models, servers, links, users), the latency
model and its elementary times, the numerical problem, serving architectures, the MILP
formulations, placements and their files, and what moving experts costs."""
