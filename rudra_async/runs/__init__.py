"""Runs built on the server and learners: local training, cluster launch, simulation, studies."""
