"""Multi-turn episodes: environments, tools and their sandbox, token-exact trajectories.

- ``environment``: the protocol (an episode starts from a row; each assistant turn is
  answered with observations or ends it) and ``ToolEnvironment``;
- ``toolcall``: tool calls parsed in the model's own chat-template format;
- ``tools``: built-in and user tools, schema checks, calls that never raise;
- ``sandbox`` (with ``private_root``, ``landlock``, ``seccomp`` and ``sandbox_boot``):
  untrusted code, contained; ``tool_worker``: a user's tools in worker processes;
- ``chat``: observation tokens as the template renders them;
- ``setup``: all of it as the ``env`` config sets it up, checked before launch.

The episodes themselves run in the rollout stream (rl/controller/episodes.py): a sample's
turns and observations are one rollout's tokens, resumable like any partial rollout.
"""
