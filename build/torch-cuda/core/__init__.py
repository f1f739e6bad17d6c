"""What every op shares: argument objects (``args``), their checks (``validate``), the
varlen / paged layout helpers (``layout``), host-side launch helpers (``launch``), the
Gluon (sm_90) imports (``gluon``) and the key-split merge kernel (``split_merge``). Nothing
here imports an op package, the api or the transformers layer."""
