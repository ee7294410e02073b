"""Pure layer functions: ``init``/``abstract`` builders, ``XParams`` attrs pytrees and ``x_apply`` math."""
