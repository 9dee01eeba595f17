"""lmstack-pp: pipeline parallelism as a parallel layout (`parallel: {name: pp, pp: 2}`)."""
