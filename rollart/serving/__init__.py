"""The policy behind an OpenAI-compatible API (issue #35): ``/v1/chat/completions``, ``/v1/completions``
and ``/v1/models`` in front of the LLMProxy, sessions that record the exact tokens of every call, the
trajectories built from them, and the ``agent`` env kind that trains harnesses written against the
``openai`` SDK. It sits on the LLMProxy (``rollart.rollout``) and below the pipelines."""
