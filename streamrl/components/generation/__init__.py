"""Generation (StreamRL §3): the stream generation service, its instances and their engines.

``service`` is the service the trainer talks to; ``pool`` keeps its instances alive (spawn,
join, fail, replace); ``instance`` and ``ray_instance`` are the handles of one instance process
or Ray actor; ``worker`` is the body of that process; ``engines`` names the engines a config can
pick; ``hf_generator`` and ``vllm_generator`` are the two engines; ``admission`` and ``kv_cache``
are the HF engine's continuous batching.
"""
