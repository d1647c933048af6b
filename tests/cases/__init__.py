"""Rank functions shared by the tests, fn(world: Communicator, *args): the gloo tests run
them on pooled ranks (the rank_pool fixture), the MPI test in one launched job per world size."""
