"""Multi-turn and tool-using episodes in the stream: environments, tools, episodes and their
runner on the generation service (``streamrl.envs.runner``)."""
