// What a standalone experiment that runs the library's own 3x GEMM and split needs (one nvcc
// translation unit, no torch): the library's sources it compiles in, and the promotion
// interval the library reads through sm90::split3x_promotion_interval(), which gemm_run.cu
// defines from a debug switch in the library and the experiment sets directly here.
#pragma once

#include "debug_switches.cu"  // split_fp16.cu reads EPIFUSE_SPLIT_WIDE_TILES
#include "sm90_gemm.cuh"
#include "split_fp16.cu"

namespace epifuse::sm90 {
uint32_t g_promotion_interval = 1;  // K-tiles per promotion of the library GEMMs run next
uint32_t split3x_promotion_interval() { return g_promotion_interval; }
}  // namespace epifuse::sm90
