"""``jaxkv generate``: stream video chunk by chunk with causal Wan 2.1 on a ring cache, writing each chunk to disk
as it finishes.

With no arguments it runs the embedded default — the toy world (`jaxkv.toyworld`), a tiny causal Wan trained in
this repository and shipped in the package — streaming its default prompt to ``OUT/video.mp4`` and
``OUT/contact_sheet.png`` with the chunk, window, sink and sampler settings it was trained for, on a fresh machine
with nothing downloaded. ``--checkpoint DIR`` uses a converted checkpoint or release (`jaxkv convert`) or another
toy-world release; ``--random-weights`` (with ``--preset``) the seeded random weights and stand-in context of the
tests. ``--context FILE`` reads precomputed text embeddings (with ``--guidance-scale``, pass ``--negative-context
FILE`` too) or ``--prompt TEXT`` encodes one (``--text-encoder DIR``, default the release's or the embedded tiny
umT5); ``--precision bfloat16`` holds the weights in bfloat16. Each chunk is also decoded into ``OUT/video.mp4``
(a toy world's latent map, ``--vae DIR``, or a tiny random VAE; ``--no-video`` turns it off).

Modules, one concern each:
  options        the command line and the checks that need no model (`build_parser`, `DEFAULTS`, `UsageError`)
  settings       the settings resolved once (defaults < release < saved session < flags) into a frozen `Settings`
  toy            the toy-world default: the model choice, its release settings (a layer), its prompts and decoder
  inputs         the model config and params, the text context; shapes and finiteness checked
  given          --image / --video: the frames a stream continues (`jaxkv.continuation`), read before anything runs
  outputs        the output directory: safety checks, per-chunk sinks, the manifest, `load_latents`
  preview        the latent-to-RGB projection and the bounded latent preview (`PreviewSink`); png: the PNG writer
  video          the decode of each chunk into the mp4 (`Mp4Sink`, any `StreamDecoder`-like decoder)
  contact_sheet  the bounded grid of decoded frames spread over the stream (`ContactSheet`)
  loop           the run: build the stream, hand each chunk to the sinks, finish the files; `main`
  stopping       the stop signals (`Stop`): finish the chunk, or abandon a save cleanly
  report         the summary: its head, the chunk timing and throughputs (`DeviceClock`), the printed lines

The output directory's layout is documented in `jaxkv.generate.outputs`.
"""

from jaxkv.generate.inputs import load_context, standin_context
from jaxkv.generate.loop import GenerationError, main, run
from jaxkv.generate.options import DEFAULTS, POLICIES, UsageError, build_parser
from jaxkv.generate.outputs import latent_chunks, load_latents
from jaxkv.generate.png import write_png
from jaxkv.generate.preview import latent_to_rgb, preview_image

__all__ = [
    "DEFAULTS",
    "POLICIES",
    "GenerationError",
    "UsageError",
    "build_parser",
    "latent_chunks",
    "latent_to_rgb",
    "load_context",
    "load_latents",
    "main",
    "preview_image",
    "run",
    "standin_context",
    "write_png",
]
