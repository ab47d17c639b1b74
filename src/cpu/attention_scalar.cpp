// The portable copy of the attention kernels (attention_kernels.hpp): the online softmax one row at
// a time, for the scalar level and for CPUs other than x86-64.
#define OASISKV_ATTENTION_NAMESPACE attention_scalar
#include "attention_kernels.inc"
