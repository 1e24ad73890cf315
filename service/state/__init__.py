"""gangserve's state, one owner per piece:

- `paths`: the state directory (`GANGSERVE_STATE_DIR`) and path containment.
"""
