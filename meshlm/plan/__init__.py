"""`meshlm plan`: predict each mesh's memory, collectives and step time for one training job, rank the
meshes, and check the best against the compiler.

Modules, each importing only from those above it in this list:

    job          the job (model, batch, devices, pipeline flags) and one device's share of it
    hardware     the hardware catalog
    schedule     readings of a pipeline's static schedule table
    state_bytes  exact bytes of parameters, gradients and optimizer state on any mesh
    memory       the memory pie of a mesh without pipeline stages
    comms        its collectives, and the time collectives take on the hardware's links
    cost         the operator table and the step-time model
    pipeline     the same figures for meshes with pipeline stages, built on the four above
    estimate     picks the flat or the pipelined estimate by the mesh's pp
    search       every mesh evaluated and ranked
    verify       the best plans compiled and compared (with `meshlm.hlo`)
    report       tables, JSON and a chart
"""
