"""``jaxkv generate``: stream video latents chunk by chunk with causal Wan 2.1 on a ring cache, writing each chunk
to disk as it finishes.

With no arguments it runs the embedded default — the ``tiny`` preset with seeded random weights and a seeded
stand-in text context — so it works on a fresh machine with nothing downloaded. ``--checkpoint DIR`` uses a
converted checkpoint (`jaxkv convert`); ``--context FILE`` reads precomputed text embeddings (with
``--guidance-scale``, pass ``--negative-context FILE`` too) or ``--prompt TEXT`` encodes one (``--text-encoder DIR``,
default the embedded tiny umT5); ``--param-dtype bfloat16`` holds the weights in bfloat16. Each chunk is also
decoded into ``OUT/video.mp4`` (``--vae DIR``, default a tiny random VAE; ``--no-video`` turns it off).

Modules, one concern each:
  options   the command line and the checks that need no model (`build_parser`, `DEFAULTS`, `UsageError`)
  inputs    the model config and params, the text context; shapes and finiteness checked
  outputs   the output directory: safety checks, per-chunk sinks, the manifest, `load_latents`
  preview   the latent-to-RGB projection and the bounded contact sheet (`PreviewSink`); png: the PNG writer
  video     the VAE decode of each chunk into the mp4 (`Mp4Sink`)
  loop      the loop: signals, timing, the summary, `main`

The output directory's layout is documented in `jaxkv.generate.outputs`.
"""

from jaxkv.generate.inputs import load_context, standin_context
from jaxkv.generate.options import DEFAULTS, POLICIES, UsageError, build_parser
from jaxkv.generate.outputs import latent_chunks, load_latents
from jaxkv.generate.png import write_png
from jaxkv.generate.preview import latent_to_rgb, preview_image
from jaxkv.generate.loop import GenerationError, main, run

__all__ = ["DEFAULTS", "POLICIES", "GenerationError", "UsageError", "build_parser", "latent_chunks",
           "latent_to_rgb", "load_context", "load_latents", "main", "preview_image", "run", "standin_context",
           "write_png"]
