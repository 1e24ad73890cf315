"""gangserve: a persistent tensor-parallel attention gang behind Ray Serve."""
