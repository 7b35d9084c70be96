"""The toy world: a procedural video world of coloured bouncing shapes, the tiny model trained on it inside this
repository (the embedded default of ``jaxkv generate``), and a quality metric that can fail.

  world     the world itself: scenes, prompts, deterministic physics, numpy rendering
  latents   the latent space: a fixed linear map of 4x4 pixel patches to 16 channels and back
  text      the word-level tokenizer and the tiny umT5 encoder of the prompts
  model     the toy model's configuration, streaming settings and release directory (load / save)
  train     training from scratch on CPU: teacher forcing over a sink-plus-window cache, then self-forcing on the ring
  clips     the training clips, laid out as a full cache holds them
  losses    the training objectives: teacher forcing, self-forcing and its colour-share and outline terms
  snapshot  a training run's snapshots, which --resume continues from
  sample    streaming a toy model to frames
  detect    finding the shapes in frames: colour masks, one object per colour, its features
  metric    a quality metric of generated toy-world video: score adherence, continuity, drift of what detect finds
  quality   the bar a model must clear (``jaxkv toyworld check``)
  cli       ``jaxkv toyworld train | check``
"""
