// amp: mixed precision (autocast + a loss scaler with PyTorch's GradScaler semantics). The
// callback and the scaler live in amp.h, where tests and a future checkpoint hook reach them.
#include "amp.h"

FRUGAL_PLUGIN(frugal::amp::Amp, frugal::amp::AmpOptions, "amp",
              "mixed precision: autocast (bfloat16 on cpu, float16 on cuda) and a loss scaler",
              "1.0.0")
