"""What a fused call uses at run time besides its route: per-device resources (``streams``: side stream, counters,
fault records), the failure contract's host side (``faults``) and the GEMM kernel choice for a call
(``kernel_select``). The routes themselves are ``flashoverlap_inductor.routes``."""
