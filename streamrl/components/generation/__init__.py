"""Generation (StreamRL §3): the stream generation service, its instances and their engines.

``service`` is the service the trainer talks to; it holds a ``pool`` that keeps its instances
alive (spawn, join, fail, replace) and reads their messages; ``instance`` and ``ray_instance``
are the handles of one instance process or Ray actor; ``worker`` is the body of that process;
``engines`` holds the engine objects (``HFEngine``, ``VLLMEngine``) that build each instance's
generator in its process; ``hf_generator`` and ``vllm_generator`` are those generators;
``admission``, ``slot_cache`` and ``slot_sequence`` are the HF generator's continuous
batching.
"""
