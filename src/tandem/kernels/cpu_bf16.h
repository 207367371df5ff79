/* bfloat16 <-> float32 for Tandem's C kernels (cpu_attention.c, cpu_layers.c). */
#ifndef TANDEM_CPU_BF16_H
#define TANDEM_CPU_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static inline uint16_t float_to_bf16(float value) {
    /* Round to nearest even, as torch's conversion does. */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* `value` rounded to bfloat16 and back: the result of a torch bfloat16 operation. */
static inline float round_bf16(float value) {
    return bf16_to_float(float_to_bf16(value));
}

#endif
