// The codecs' names, indexed by the wire's Codec number (hiqcache.v1.Codec, docs/design.md "Wire
// contract"): the contract name and the short one of the namespace text, hiqctl and the engine
// options. The daemon's kernels::CodecKind (record_format.h) and the client's Codec (pool_spec.h)
// are numbered as the wire and name every codec through this one table; codec_names_test holds
// it to the proto. A codec is added as a new number with its row here, never renamed.
#pragma once

#include <cstdint>

namespace hiqcache {

inline constexpr uint32_t kCodecCount = 9;

struct CodecNames {
  const char* contract;  // "CODEC_INT8_PER_HEAD"
  const char* text;      // "int8_per_head": the contract name, lower case, without "CODEC_"
};

inline constexpr CodecNames kCodecNames[kCodecCount] = {
    {"CODEC_INT8_PER_HEAD", "int8_per_head"},
    {"CODEC_RAW", "raw"},
    {"CODEC_FP8_E4M3_PER_HEAD", "fp8_e4m3_per_head"},
    {"CODEC_INT4_G32_PER_HEAD", "int4_g32_per_head"},
    {"CODEC_INT4_KIVI", "int4_kivi"},
    {"CODEC_INT4_HADAMARD", "int4_hadamard"},
    {"CODEC_INT5_ALLOT", "int5_allot"},
    {"CODEC_INT6_ALLOT", "int6_allot"},
    {"CODEC_INT4_ALLOT", "int4_allot"},
};

}  // namespace hiqcache
