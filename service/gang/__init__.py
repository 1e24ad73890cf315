"""The gang: rank processes forming one persistent process group (see gang.Gang)."""
