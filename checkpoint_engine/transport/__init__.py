"""Ways of moving bytes between a parameter-server rank and its engine, behind the pipeline's
interfaces; each new way of moving weights is one more module here.

    devices          device backends the pipeline is given (CPU, CUDA)
    shm              anonymous shared memory (memfd) for one host
    mooncake         P2P one-sided reads through Mooncake's transfer engine
    engine_reads     a pull the engine reads itself, straight into its parameters
    load_rendezvous  an update into an engine that waits in its load step
    prefault         populate freshly allocated host pages in one call
"""
