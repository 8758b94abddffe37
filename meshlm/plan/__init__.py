"""`meshlm plan`: predict each mesh's memory, collectives and step time for one training job, rank the
meshes, and check the best against the compiler.

Modules, each importing only from those above it in this list:

    job, hardware   the job and one device's share of it; the hardware catalog
    schedule        readings of a pipeline's static schedule table
    state_bytes     exact bytes of parameters, gradients and optimizer state on any mesh
    memory, comms   the memory pie and the collectives of a mesh without pipeline stages
    cost            the operator table and the step-time model
    pipeline        the same figures for meshes with pipeline stages; estimate picks one
    remat, fit      the `--remat` policies tried and the memory fit of `--remat=auto`
    search, report  every mesh evaluated and ranked; tables, JSON and a chart

Checking the best plans by compiling them is `meshlm.explain.verify` (with `meshlm.hlo`).
"""
