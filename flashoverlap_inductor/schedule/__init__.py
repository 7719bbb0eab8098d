"""The pure schedule of a fused call, shared by the CPU route and the GPU routes: group plans and buffer layouts
(``plan``), per-group steps (``steps``) and the GEMM's tile-row order (``row_order``). No device code; every
function depends only on call shapes and settings that all ranks share."""
