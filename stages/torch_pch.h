// torch_pch.h: the one place libtorch's headers come in; precompiled once per torch target.
#pragma once
#include <torch/torch.h>
