// KV block kernels of kvroute, compiled at run time with NVRTC (kvroute-kernels, cuda.rs).
// The *_pieces kernels walk a list of pieces (one CUDA block per piece, grid-stride over the
// list); move_blocks, fill_blocks and verify_blocks derive their pieces from a slot list
// passed by value and the layout, so queuing them uploads nothing. Addresses
// are absolute device addresses checked against their buffers by the Rust caller.
// The CPU reference of each kernel is in reference.rs and must stay byte-identical.

typedef unsigned long long u64;
typedef unsigned int u32;

struct Piece { u64 src; u64 dst; u32 len; u32 pad; };
struct PatternPiece { u64 addr; u64 seq; u32 piece; u32 len; u32 block; u32 pad; };

// Steele, Lea, Flood: "Fast splittable pseudorandom number generators", OOPSLA 2014.
__device__ __forceinline__ u64 splitmix64(u64 x) {
    u64 z = x + 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// Word w of the pattern of piece `piece` of block `seq` (reference.rs: pattern_word).
__device__ __forceinline__ u64 pattern_word(u64 seq, u32 piece, u64 w) {
    return splitmix64(seq ^ ((u64)piece << 40) ^ w);
}

// Little-endian word w of a piece of `len` bytes at `p`, zero-padded past the end.
__device__ __forceinline__ u64 load_word(const unsigned char* p, u32 len, u64 w, bool aligned) {
    if (aligned) return ((const u64*)p)[w];
    u64 word = 0;
    for (u32 b = 0; b < 8; b++) {
        u64 i = w * 8 + b;
        if (i < len) word |= (u64)p[i] << (8 * b);
    }
    return word;
}

// Copies `len` bytes from `s` to `d` with the calling CUDA block: 16-byte vectors, four
// loads in flight per thread before their stores, where both ends and the length are
// 16-byte aligned; bytes otherwise.
__device__ __forceinline__ void copy_bytes(const unsigned char* s, unsigned char* d, u32 len) {
    if ((((u64)s | (u64)d | (u64)len) & 15) == 0) {
        const uint4* s4 = (const uint4*)s;
        uint4* d4 = (uint4*)d;
        const u32 n = len / 16, step = blockDim.x;
        u32 i = threadIdx.x;
        for (; i + 3 * step < n; i += 4 * step) {
            const uint4 a = s4[i], b = s4[i + step], c = s4[i + 2 * step], e = s4[i + 3 * step];
            d4[i] = a;
            d4[i + step] = b;
            d4[i + 2 * step] = c;
            d4[i + 3 * step] = e;
        }
        for (; i < n; i += step) d4[i] = s4[i];
    } else {
        for (u32 i = threadIdx.x; i < len; i += blockDim.x) d[i] = s[i];
    }
}

// Copies every piece (vectors or bytes, decided per piece by copy_bytes).
extern "C" __global__ void copy_pieces(const Piece* pieces, u32 n) {
    for (u32 p = blockIdx.x; p < n; p += gridDim.x) {
        const Piece pc = pieces[p];
        copy_bytes((const unsigned char*)pc.src, (unsigned char*)pc.dst, pc.len);
    }
}

// The G1 slots of one move_blocks launch, passed by value in the kernel's parameters (no
// upload, nothing to keep alive after the launch is queued): cuda.rs SlotList, 2,052 bytes,
// under the 4 KiB parameter limit of every architecture.
#define MOVE_MAX_BLOCKS 512
struct SlotList { u32 n; u32 slots[MOVE_MAX_BLOCKS]; };

// Moves whole blocks between G1 (piece p of slot s at (p * g1_blocks + s) * piece_len) and a
// packed buffer (piece p of its j-th block at (j * pieces + p) * piece_len): gathers G1 slot
// list.slots[j] into packed block j when to_packed, scatters packed block j into it
// otherwise (layout.rs; the same bytes as copy_pieces over plan::gather / plan::scatter).
extern "C" __global__ void move_blocks(u64 g1, u64 packed, u64 g1_blocks, u32 pieces,
                                       u32 piece_len, u32 to_packed, const SlotList list) {
    const u64 total = (u64)list.n * pieces;
    for (u64 q = blockIdx.x; q < total; q += gridDim.x) {
        const u32 j = (u32)(q / pieces), p = (u32)(q % pieces);
        unsigned char* in_g1 = (unsigned char*)(g1 + ((u64)p * g1_blocks + list.slots[j]) * piece_len);
        unsigned char* in_packed = (unsigned char*)(packed + ((u64)j * pieces + p) * piece_len);
        if (to_packed) {
            copy_bytes(in_g1, in_packed, piece_len);
        } else {
            copy_bytes(in_packed, in_g1, piece_len);
        }
    }
}

// Writes the pattern of piece `piece` of block `seq` into the `len` bytes at `d`, with the
// calling CUDA block.
__device__ __forceinline__ void fill_piece(unsigned char* d, u64 seq, u32 piece, u32 len) {
    u64 words = ((u64)len + 7) / 8;
    bool aligned = (((u64)d | (u64)len) & 7) == 0;
    for (u64 w = threadIdx.x; w < words; w += blockDim.x) {
        u64 word = pattern_word(seq, piece, w);
        if (aligned) {
            ((u64*)d)[w] = word;
        } else {
            for (u32 b = 0; b < 8; b++) {
                u64 i = w * 8 + b;
                if (i < len) d[i] = (unsigned char)(word >> (8 * b));
            }
        }
    }
}

// Adds into *out, with the calling CUDA block, how many words of the `len` bytes at `s`
// differ from the pattern of piece `piece` of block `seq`.
__device__ __forceinline__ void verify_piece(const unsigned char* s, u64 seq, u32 piece, u32 len,
                                             u32* out) {
    u64 words = ((u64)len + 7) / 8;
    bool aligned = (((u64)s | (u64)len) & 7) == 0;
    u32 bad = 0;
    for (u64 w = threadIdx.x; w < words; w += blockDim.x) {
        u64 want = pattern_word(seq, piece, w);
        u32 tail = (u32)min((u64)8, (u64)len - w * 8);
        if (tail < 8) want &= (1ULL << (8 * tail)) - 1;
        bad += load_word(s, len, w, aligned) != want;
    }
    for (int offset = 16; offset > 0; offset /= 2) bad += __shfl_down_sync(0xffffffffu, bad, offset);
    if ((threadIdx.x & 31) == 0 && bad) atomicAdd(out, bad);
}

// Writes each piece's deterministic pattern (stands in for a prefill's KV writes).
extern "C" __global__ void fill_pieces(const PatternPiece* pieces, u32 n) {
    for (u32 p = blockIdx.x; p < n; p += gridDim.x) {
        const PatternPiece pc = pieces[p];
        fill_piece((unsigned char*)pc.addr, pc.seq, pc.piece, pc.len);
    }
}

// Adds each piece's checksum into out[piece.block]: the wrapping sum over its words of
// splitmix64(word ^ piece << 48 ^ w). Order-free, so the reduction is deterministic.
extern "C" __global__ void checksum_pieces(const PatternPiece* pieces, u32 n, u64* out) {
    for (u32 p = blockIdx.x; p < n; p += gridDim.x) {
        const PatternPiece pc = pieces[p];
        const unsigned char* s = (const unsigned char*)pc.addr;
        u64 words = ((u64)pc.len + 7) / 8;
        bool aligned = ((pc.addr | (u64)pc.len) & 7) == 0;
        u64 acc = 0;
        for (u64 w = threadIdx.x; w < words; w += blockDim.x) {
            acc += splitmix64(load_word(s, pc.len, w, aligned) ^ ((u64)pc.piece << 48) ^ w);
        }
        for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
        if ((threadIdx.x & 31) == 0) atomicAdd(&out[pc.block], acc);
    }
}

// Counts, into out[piece.block], the words of each piece that differ from its pattern.
extern "C" __global__ void verify_pieces(const PatternPiece* pieces, u32 n, u32* out) {
    for (u32 p = blockIdx.x; p < n; p += gridDim.x) {
        const PatternPiece pc = pieces[p];
        verify_piece((const unsigned char*)pc.addr, pc.seq, pc.piece, pc.len, &out[pc.block]);
    }
}

// G1 slots and the block each holds (the seed of its pattern), passed by value like SlotList:
// cuda.rs SeqList, 3,080 bytes (the u64 array starts at byte 1,032).
#define SEQ_MAX_BLOCKS 256
struct SeqList { u32 n; u32 slots[SEQ_MAX_BLOCKS]; u64 seqs[SEQ_MAX_BLOCKS]; };

// fill_pieces over every piece of G1 slots list.slots[j] with the pattern of list.seqs[j]
// (plan::g1_blocks' pieces, derived here from the layout as move_blocks derives its own).
extern "C" __global__ void fill_blocks(u64 g1, u64 g1_blocks, u32 pieces, u32 piece_len,
                                       const SeqList list) {
    const u64 total = (u64)list.n * pieces;
    for (u64 q = blockIdx.x; q < total; q += gridDim.x) {
        const u32 j = (u32)(q / pieces), p = (u32)(q % pieces);
        unsigned char* d = (unsigned char*)(g1 + ((u64)p * g1_blocks + list.slots[j]) * piece_len);
        fill_piece(d, list.seqs[j], p, piece_len);
    }
}

// verify_pieces over the same pieces: out[j] gains the mismatching words of slot j.
extern "C" __global__ void verify_blocks(u64 g1, u64 g1_blocks, u32 pieces, u32 piece_len,
                                         u32* out, const SeqList list) {
    const u64 total = (u64)list.n * pieces;
    for (u64 q = blockIdx.x; q < total; q += gridDim.x) {
        const u32 j = (u32)(q / pieces), p = (u32)(q % pieces);
        const unsigned char* s =
            (const unsigned char*)(g1 + ((u64)p * g1_blocks + list.slots[j]) * piece_len);
        verify_piece(s, list.seqs[j], p, piece_len, &out[j]);
    }
}
