"""The in-process transformers backend: the only package of modelyard that imports torch.

Its modules import torch and transformers lazily or at their top; this file imports nothing, so
that reading a submodule's pure parts (params, precision) stays cheap.

Generation (`generator.BatchGenerator`, with `paged_kv` (paged KV, the default) or `kvbatch` (the
padded layout), `sampling`, `detok`, `prefix_cache`, `params`) is continuous batching written
here, not transformers' own; so is the paged KV (transformers 5.24's `PagedAttentionCache` is
built and driven by its continuous-batching manager, whose limits follow). Why: transformers 5.23's
continuous batching (`init_continuous_batching`, paged cache with `paged|sdpa`, block prefix
sharing, `cancel_request`) runs on CPU and is about as fast for greedy batches (`bench/batch_core.py
--hf-cb`, random Llama hidden 256 x 4 layers, 2 cores, 64 tokens, 1/4/8/16 requests: 168/449/768/
1008 tok/s against our 169/554/930/1612, serialized `generate` 160-210), but one manager has one
sampling config: `do_sample` is global (greedy and sampled requests cannot share a batch),
per-request temperature/top-k/top-p exist only if the manager was built with non-default values,
there is no per-request seed (one RNG), no min_p, no presence/frequency penalty, a repetition
penalty that sees only the batch's last tokens, logprobs of the chosen token only (no top-N), no
stop strings; and it switches the model's attention implementation while it runs. Adding those
means sampling outside its step, which its API does not expose. Our loop is one worker thread,
a left-padded batched `DynamicCache` (2D mask + explicit position ids, layers appending in place)
for decoding, chunked prefill of new prompts as a second padded batch merged in when done, rows
dropped as they finish: the same modelling code and kernels as `generate`, so greedy output is
`model.generate(do_sample=False)` token for token (tested), and every request samples with its own
parameters and seed.
"""
