"""rudra-async side by side with its peers on one machine: ``python -m benchmarks.peers``
(see :mod:`benchmarks.peers.driver`)."""
