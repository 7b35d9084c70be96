"""The toy world: a procedural video world of coloured bouncing shapes, the tiny model trained on it inside this
repository (the embedded default of ``jaxkv generate``), and a quality metric that can fail.

  world     the world itself: scenes, prompts, deterministic physics, numpy rendering
  metric    a quality metric of generated toy-world video: detect the shapes, score adherence, continuity, drift
"""
