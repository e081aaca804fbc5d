// The sampler's entry points inside the native module (dgr_sampler.cpp): the ABI's dgr_sample
// (dgr_shard.cpp) and the native links' last stage (dgr_link.cpp) both call dgr_sample_row.
#ifndef DGR_SAMPLER_H
#define DGR_SAMPLER_H

#include "dgr_shard.h"

// Checks the parameters: DGR_OK, or DGR_E_INVALID_ARGUMENT with the reason in `why`.
int dgr_sampling_valid(const dgr_sampling * params, char * why, size_t why_size);

// Whether a penalty is set (and looks at any token): the history is read only then.
int dgr_sampling_penalized(const dgr_sampling * params);

// The token of one row (docs/sampling.md): DGR_OK, or a status with the reason in `why`.
int dgr_sample_row(const dgr_sampling * params, const float * logits, uint32_t n_vocab, uint32_t position,
                   const int32_t * history, uint32_t n_history, int32_t * out_token, char * why, size_t why_size);

#endif
