"""The generation engine: a KV cache on the mesh, continuous batching, scoring (docs/serve.md).

batching   `Engine`: slots, the loop that admits, decodes, delivers and scores
request    what is submitted (`GenerationRequest`) and the handles its events stream from
queue      requests waiting for slots, shared fairly between submissions
limits     the default limits on the queue, a request's tokens and its log-probabilities
sampling   sampling settings (`SamplingParams`) and the jitted sampler
shapes     the compiled buckets (prompt lengths, decode rows and cache lengths)
steps      the jitted prefill and decode steps over the cache
warmup     the order shapes compile in, and the progress bar
scoring    log-probabilities of token sequences (`Scorer`)
text       tokens to text as they arrive, and stop strings
multihost  several processes: process 0 publishes each step, the others repeat it
"""
