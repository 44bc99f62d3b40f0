//! The kernels on a CUDA device: [`Gpu`] (a context, the compiled module, one launch per
//! operation over a piece list or, for a transfer's blocks, a slot list) and [`GpuKv`] (a
//! worker's G1 on the device, G2 in pinned host memory, offload and onboard pipelined over a
//! copy stream and a gather/scatter stream, completion signalled by event).
//!
//! What blocks the calling thread: [`GpuKv::is_done`] never does (an event query), and
//! neither does queuing a transfer or an onboard's verification, whose per-block results come
//! back into pinned host memory behind the transfer's own event ([`GpuKv::onboard_checked`],
//! read by [`GpuKv::finish`] once done), nor does [`GpuKv::fill`]: the kernels of the
//! worker's path take their slots by value in the launch's parameters (`move_blocks`,
//! `fill_blocks`, `verify_blocks`), so fills, transfers and their verifications upload no
//! descriptors. What may: the operations over a piece list ([`Gpu::copy`], [`Gpu::fill`],
//! [`Gpu::checksum`], [`Gpu::verify`], and through them [`GpuKv::checksum_g1`] and
//! [`GpuKv::fill_by_pieces`]: tests and benchmarks) upload their descriptors from pageable
//! memory, which CUDA documents as possibly synchronous with respect to the host; a verification whose block count exceeds
//! every pinned result buffer pooled so far allocates a new one (page-locking); [`Transfer::wait`], [`GpuKv::finish`] of a
//! transfer not yet done, the `*_g1`/`*_g2` checks and [`GpuKv::synchronize`] wait by design
//! (tests and benchmarks); creating a [`GpuKv`] compiles and allocates, and dropping one
//! synchronises its streams.
//!
//! Nothing here links CUDA at build time: cudarc opens `libcuda` and `libnvrtc` when
//! [`Gpu::new`] first runs, which checks for them first and names what is missing. Kernels
//! are compiled from `kernels.cu` once per device architecture per process.
//!
//! Safety: the `unsafe` blocks are kernel launches, raw async copies, pinned allocations,
//! the kernel parameter types' `DeviceRepr` and turning cudarc's event tracking off for a
//! [`GpuKv`]'s context. Every piece list and slot list is checked against its buffers' sizes
//! before a launch ([`crate::plan`]; `g1_geometry` and `g1_slot` for G1, and for the packed
//! buffer of `move_blocks` and the results of `queue_verify_slots` their own checks), so kernels only touch memory the
//! buffers own, and buffers outlive the work queued on them because [`GpuKv`] owns them,
//! orders its streams by events and synchronises them before they drop. On a device without
//! stream-ordered memory pools (`cuMemAllocAsync`), cudarc frees a buffer by synchronising
//! its stream: a verification's result buffer (and a piece-list operation's descriptors)
//! would then wait there (H100 and later have the pools).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DeviceRepr, DriverError, LaunchConfig, PinnedHostSlice, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::{CompileOptions, Ptx};
use parking_lot::Mutex;

use crate::layout::KvLayout;
use crate::plan::{self, PatternPiece, Piece, PieceError};
use crate::reference;

/// The CUDA source of every kernel.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Threads per CUDA block (a multiple of the warp, for the shuffles in the reductions).
const THREADS: u32 = 256;

/// Why the GPU path cannot run or an operation failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No driver library.
    #[error(
        "no CUDA driver: libcuda.so was not found (install the NVIDIA driver, or run the worker with --device cpu)"
    )]
    NoDriver,
    /// No NVRTC library.
    #[error(
        "no NVRTC: libnvrtc.so was not found (use a CUDA runtime image or add the CUDA toolkit's lib64 to LD_LIBRARY_PATH)"
    )]
    NoNvrtc,
    /// No such device.
    #[error("no CUDA device {ordinal}: {count} visible")]
    NoDevice {
        /// Requested ordinal.
        ordinal: usize,
        /// Devices visible.
        count: i32,
    },
    /// NVRTC rejected the source (a bug, or an architecture NVRTC does not know).
    #[error("compiling the KV kernels for {arch}: {message}")]
    Compile {
        /// Target architecture.
        arch: String,
        /// NVRTC's log.
        message: String,
    },
    /// A driver call failed.
    #[error("CUDA: {0}")]
    Driver(#[from] DriverError),
    /// A piece outside its buffer.
    #[error(transparent)]
    Piece(#[from] PieceError),
}

/// The kernels' entry points in `kernels.cu`.
pub const KERNELS: [&str; 7] = [
    "copy_pieces",
    "fill_pieces",
    "checksum_pieces",
    "verify_pieces",
    "move_blocks",
    "fill_blocks",
    "verify_blocks",
];

/// Most blocks one `move_blocks` launch moves: its slot list travels by value in the kernel's
/// parameters (`struct SlotList` in `kernels.cu`: 4 + 4 × 512 bytes, under the 4 KiB
/// parameter limit of every architecture), so offload and onboard upload no descriptors.
pub const MOVE_MAX_BLOCKS: usize = 512;

/// What each lane of a [`GpuKv`]'s staging area aims to hold: a transfer moves lane by lane,
/// the gather (or scatter) of one lane overlapping the PCIe copy of the one before, and a
/// copy this size runs at the link's rate (16 MiB: 8 blocks of Llama-8B, about 0.3 ms of
/// PCIe 5). Smaller lanes start a transfer's copy sooner, larger ones cost fewer launches.
const LANE_BYTES: usize = 16 << 20;

/// `struct SlotList` in `kernels.cu`: the G1 slots of one `move_blocks` launch.
#[repr(C)]
#[derive(Clone, Copy)]
struct SlotList {
    n: u32,
    slots: [u32; MOVE_MAX_BLOCKS],
}

// SAFETY: plain `repr(C)` data with the layout of the kernel's by-value parameter.
unsafe impl DeviceRepr for SlotList {}

const _: () = assert!(std::mem::size_of::<SlotList>() == 4 + 4 * MOVE_MAX_BLOCKS);

/// Most blocks one `fill_blocks` or `verify_blocks` launch covers: their slots and the blocks
/// whose patterns they hold travel by value (`struct SeqList` in `kernels.cu`: 3,080 bytes,
/// under the 4 KiB parameter limit with the other arguments); longer lists take several
/// launches, and upload nothing either.
pub const SEQ_MAX_BLOCKS: usize = 256;

/// `struct SeqList` in `kernels.cu`: G1 slots and the `seq` of each one's pattern.
#[repr(C)]
#[derive(Clone, Copy)]
struct SeqList {
    n: u32,
    slots: [u32; SEQ_MAX_BLOCKS],
    seqs: [u64; SEQ_MAX_BLOCKS],
}

// SAFETY: plain `repr(C)` data with the layout of the kernels' by-value parameter.
unsafe impl DeviceRepr for SeqList {}

const _: () = assert!(std::mem::offset_of!(SeqList, seqs) == 1032);
const _: () = assert!(std::mem::size_of::<SeqList>() == 1032 + 8 * SEQ_MAX_BLOCKS);

/// Whether NVRTC (`libnvrtc.so`) can be opened; it needs no GPU.
pub fn nvrtc_present() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles every kernel for compute capability `major.minor` with NVRTC, as [`Gpu::new`]
/// does for its device (no GPU needed): a check that the source builds for an
/// architecture before any device of it is met.
pub fn compile(major: i32, minor: i32) -> Result<Ptx, GpuError> {
    if !nvrtc_present() {
        return Err(GpuError::NoNvrtc);
    }
    ptx_for(major, minor)
}

/// PTX per compute capability, compiled once per process.
fn ptx_for(major: i32, minor: i32) -> Result<Ptx, GpuError> {
    static CACHE: OnceLock<Mutex<HashMap<(i32, i32), Ptx>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    let mut cache = cache.lock();
    if let Some(ptx) = cache.get(&(major, minor)) {
        return Ok(ptx.clone());
    }
    // One string per architecture seen, for NVRTC's `&'static str` option.
    let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
    let options = CompileOptions {
        arch: Some(arch),
        name: Some("kvroute_kernels.cu".into()),
        ..CompileOptions::default()
    };
    let ptx =
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, options).map_err(|e| GpuError::Compile {
            arch: arch.into(),
            message: format!("{e:?}"),
        })?;
    cache.insert((major, minor), ptx.clone());
    Ok(ptx)
}

/// A device with the kernels loaded.
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    copy: CudaFunction,
    fill: CudaFunction,
    checksum: CudaFunction,
    verify: CudaFunction,
    move_blocks: CudaFunction,
    fill_blocks: CudaFunction,
    verify_blocks: CudaFunction,
    /// Device name.
    pub name: String,
    /// Compute capability.
    pub arch: (i32, i32),
}

fn launch_config(pieces: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (pieces.clamp(1, 65_535) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Piece descriptors as the kernels read them (`struct Piece` in `kernels.cu`).
fn copy_words(pieces: &[Piece], src: u64, dst: u64) -> Vec<u64> {
    pieces
        .iter()
        .flat_map(|p| [src + p.src, dst + p.dst, u64::from(p.len)])
        .collect()
}

/// `struct PatternPiece` in `kernels.cu`.
fn pattern_words(pieces: &[PatternPiece], base: u64) -> Vec<u64> {
    pieces
        .iter()
        .flat_map(|p| {
            [
                base + p.addr,
                p.seq,
                u64::from(p.piece) | (u64::from(p.len) << 32),
                u64::from(p.block),
            ]
        })
        .collect()
}

/// The buffers of one `move_blocks` launch: G1 `(address, bytes, blocks)` and the packed
/// buffer `(address, bytes)`.
#[derive(Clone, Copy)]
struct MoveArgs<'a> {
    layout: &'a KvLayout,
    g1: (u64, usize, usize),
    packed: (u64, usize),
}

/// A block at `start` outside a buffer of `len` bytes.
fn outside(
    index: usize,
    buffer: &'static str,
    start: usize,
    block: usize,
    len: usize,
) -> PieceError {
    PieceError {
        index,
        buffer,
        start: start as u64,
        end: start.saturating_add(block) as u64,
        len,
    }
}

/// Whether `blocks` blocks of `block` bytes fit in `len` bytes.
fn fits(blocks: usize, block: usize, len: usize) -> bool {
    blocks.checked_mul(block).is_some_and(|b| b <= len)
}

/// Checks that `g1_blocks` blocks of `layout` fit in G1's `g1_len` bytes and that its
/// geometry fits the kernels' integers: `(pieces per block, bytes per piece)`.
fn g1_geometry(layout: &KvLayout, g1_len: usize, g1_blocks: usize) -> Result<(u32, u32), GpuError> {
    let block = layout.block_bytes();
    let bad = || outside(0, "g1", 0, block, g1_len).into();
    if !fits(g1_blocks, block, g1_len) || g1_blocks > u32::MAX as usize {
        return Err(bad());
    }
    match (
        u32::try_from(layout.pieces()),
        u32::try_from(layout.piece_bytes()),
    ) {
        (Ok(pieces), Ok(piece_len)) => Ok((pieces, piece_len)),
        _ => Err(bad()),
    }
}

/// Slot `slot`, at position `index` of a list, as the kernels take it: below `g1_blocks`.
fn g1_slot(
    layout: &KvLayout,
    g1_len: usize,
    g1_blocks: usize,
    index: usize,
    slot: usize,
) -> Result<u32, GpuError> {
    if slot >= g1_blocks {
        let block = layout.block_bytes();
        return Err(outside(index, "g1", slot.saturating_mul(block), block, g1_len).into());
    }
    Ok(slot as u32)
}

/// `blocks` in by-value lists of at most [`SEQ_MAX_BLOCKS`], every slot checked first (a bad
/// slot anywhere queues nothing).
fn seq_lists(
    layout: &KvLayout,
    g1_len: usize,
    g1_blocks: usize,
    blocks: &[(usize, u64)],
) -> Result<Vec<SeqList>, GpuError> {
    let mut lists = Vec::with_capacity(blocks.len().div_ceil(SEQ_MAX_BLOCKS));
    for (c, chunk) in blocks.chunks(SEQ_MAX_BLOCKS).enumerate() {
        let mut list = SeqList {
            n: chunk.len() as u32,
            slots: [0; SEQ_MAX_BLOCKS],
            seqs: [0; SEQ_MAX_BLOCKS],
        };
        for (j, &(slot, seq)) in chunk.iter().enumerate() {
            list.slots[j] = g1_slot(layout, g1_len, g1_blocks, c * SEQ_MAX_BLOCKS + j, slot)?;
            list.seqs[j] = seq;
        }
        lists.push(list);
    }
    Ok(lists)
}

impl Gpu {
    /// Opens device `ordinal` and loads the kernels (compiling them on first use per
    /// architecture).
    pub fn new(ordinal: usize) -> Result<Gpu, GpuError> {
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        if !nvrtc_present() {
            return Err(GpuError::NoNvrtc);
        }
        let count = CudaContext::device_count()?;
        if ordinal as i64 >= i64::from(count) {
            return Err(GpuError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        let arch = ctx.compute_capability()?;
        let module = ctx.load_module(ptx_for(arch.0, arch.1)?)?;
        let [
            copy,
            fill,
            checksum,
            verify,
            move_blocks,
            fill_blocks,
            verify_blocks,
        ] = KERNELS;
        Ok(Gpu {
            copy: module.load_function(copy)?,
            fill: module.load_function(fill)?,
            checksum: module.load_function(checksum)?,
            verify: module.load_function(verify)?,
            move_blocks: module.load_function(move_blocks)?,
            fill_blocks: module.load_function(fill_blocks)?,
            verify_blocks: module.load_function(verify_blocks)?,
            name: ctx.name()?,
            arch,
            ctx,
        })
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A new stream.
    pub fn stream(&self) -> Result<Arc<CudaStream>, GpuError> {
        Ok(self.ctx.new_stream()?)
    }

    /// A zeroed device buffer.
    pub fn alloc(&self, stream: &Arc<CudaStream>, bytes: usize) -> Result<CudaSlice<u8>, GpuError> {
        Ok(stream.alloc_zeros::<u8>(bytes.max(1))?)
    }

    /// Queues the copy of every piece from `src` to `dst` (device buffers) on `stream`.
    pub fn copy(
        &self,
        stream: &Arc<CudaStream>,
        src: &CudaSlice<u8>,
        dst: &mut CudaSlice<u8>,
        pieces: &[Piece],
    ) -> Result<(), GpuError> {
        plan::check_copy(pieces, src.len(), dst.len())?;
        if pieces.is_empty() {
            return Ok(());
        }
        let (s, _s) = src.device_ptr(stream);
        // Written: recorded as a write, so that a read on another stream waits for it.
        let (d, _d) = dst.device_ptr_mut(stream);
        let words = stream.clone_htod(&copy_words(pieces, s, d))?;
        let n = pieces.len() as u32;
        let mut launch = stream.launch_builder(&self.copy);
        launch.arg(&words).arg(&n);
        // SAFETY: `copy_pieces(const Piece*, u32)`; every piece was checked to lie inside
        // `src` and `dst`, which are borrowed until the launch is queued; the caller keeps
        // them allocated until the stream has run it (cudarc's per-buffer events, where its
        // event tracking is on; a `GpuKv` synchronises its streams before freeing).
        unsafe { launch.launch(launch_config(pieces.len())) }?;
        Ok(())
    }

    /// Queues the gather of G1 `slots` (of `g1_blocks`, laid out as `layout`) into the first
    /// `slots.len()` blocks of `packed`: the bytes of [`Gpu::copy`] over [`plan::gather`],
    /// with no descriptor upload (at most [`MOVE_MAX_BLOCKS`] slots).
    pub fn gather(
        &self,
        stream: &Arc<CudaStream>,
        layout: &KvLayout,
        g1: &CudaSlice<u8>,
        g1_blocks: usize,
        slots: &[usize],
        packed: &mut CudaSlice<u8>,
    ) -> Result<(), GpuError> {
        let (g1_ptr, _g) = g1.device_ptr(stream);
        let packed_len = packed.len();
        let (packed_ptr, _p) = packed.device_ptr_mut(stream);
        let args = MoveArgs {
            layout,
            g1: (g1_ptr, g1.len(), g1_blocks),
            packed: (packed_ptr, packed_len),
        };
        self.move_blocks(stream, &args, slots, true)
    }

    /// Queues the scatter of the first `slots.len()` blocks of `packed` into G1 `slots`: the
    /// bytes of [`Gpu::copy`] over [`plan::scatter`], with no descriptor upload.
    pub fn scatter(
        &self,
        stream: &Arc<CudaStream>,
        layout: &KvLayout,
        packed: &CudaSlice<u8>,
        slots: &[usize],
        g1: &mut CudaSlice<u8>,
        g1_blocks: usize,
    ) -> Result<(), GpuError> {
        let (packed_ptr, _p) = packed.device_ptr(stream);
        let g1_len = g1.len();
        let (g1_ptr, _g) = g1.device_ptr_mut(stream);
        let args = MoveArgs {
            layout,
            g1: (g1_ptr, g1_len, g1_blocks),
            packed: (packed_ptr, packed.len()),
        };
        self.move_blocks(stream, &args, slots, false)
    }

    /// Checks `slots` against both buffers and queues `move_blocks`.
    fn move_blocks(
        &self,
        stream: &Arc<CudaStream>,
        args: &MoveArgs<'_>,
        slots: &[usize],
        to_packed: bool,
    ) -> Result<(), GpuError> {
        let MoveArgs {
            layout,
            g1: (g1, g1_len, g1_blocks),
            packed: (packed, packed_len),
        } = *args;
        let (pieces, piece_len) = g1_geometry(layout, g1_len, g1_blocks)?;
        let block = layout.block_bytes();
        if slots.len() > MOVE_MAX_BLOCKS || !fits(slots.len(), block, packed_len) {
            return Err(outside(
                slots.len(),
                "packed",
                slots.len() * block,
                block,
                packed_len,
            )
            .into());
        }
        let mut list = SlotList {
            n: slots.len() as u32,
            slots: [0; MOVE_MAX_BLOCKS],
        };
        for (i, &slot) in slots.iter().enumerate() {
            list.slots[i] = g1_slot(layout, g1_len, g1_blocks, i, slot)?;
        }
        if slots.is_empty() {
            return Ok(());
        }
        let (g1_blocks, to_packed) = (g1_blocks as u64, u32::from(to_packed));
        let mut launch = stream.launch_builder(&self.move_blocks);
        launch
            .arg(&g1)
            .arg(&packed)
            .arg(&g1_blocks)
            .arg(&pieces)
            .arg(&piece_len)
            .arg(&to_packed)
            .arg(&list);
        // SAFETY: `move_blocks(u64, u64, u64, u32, u32, u32, SlotList)`; every slot was checked
        // below `g1_blocks`, whose blocks fit in G1, and the packed blocks fit in `packed`, so
        // every piece lies inside its buffer; both buffers are borrowed by the caller, which
        // keeps them allocated until the stream has run the launch.
        unsafe { launch.launch(launch_config(slots.len() * pieces as usize)) }?;
        Ok(())
    }

    /// Queues writing into each G1 slot `blocks[j].0` of `g1` (`g1_blocks` slots laid out as
    /// `layout`) the pattern of block `blocks[j].1`: the bytes of [`Gpu::fill`] over
    /// [`plan::g1_blocks`], with no descriptor upload (a launch per [`SEQ_MAX_BLOCKS`]).
    pub fn fill_slots(
        &self,
        stream: &Arc<CudaStream>,
        layout: &KvLayout,
        g1: &mut CudaSlice<u8>,
        g1_blocks: usize,
        blocks: &[(usize, u64)],
    ) -> Result<(), GpuError> {
        let (pieces, piece_len) = g1_geometry(layout, g1.len(), g1_blocks)?;
        let lists = seq_lists(layout, g1.len(), g1_blocks, blocks)?;
        let (g1_ptr, _g) = g1.device_ptr_mut(stream);
        let g1_blocks = g1_blocks as u64;
        for list in &lists {
            let mut launch = stream.launch_builder(&self.fill_blocks);
            launch
                .arg(&g1_ptr)
                .arg(&g1_blocks)
                .arg(&pieces)
                .arg(&piece_len)
                .arg(list);
            // SAFETY: `fill_blocks(u64, u64, u32, u32, SeqList)`; every slot was checked below
            // `g1_blocks`, whose blocks fit in G1, so every piece lies inside it; G1 is
            // borrowed by the caller, which keeps it allocated until the stream has run this.
            unsafe { launch.launch(launch_config(list.n as usize * pieces as usize)) }?;
        }
        Ok(())
    }

    /// Queues the verification of G1 slots against their blocks' patterns: `out[j]` gains the
    /// mismatching words of slot `blocks[j].0` against block `blocks[j].1` (`out` zeroed by
    /// the caller). [`Gpu::queue_verify`] over [`plan::g1_blocks`], with no descriptor
    /// upload.
    pub fn queue_verify_slots(
        &self,
        stream: &Arc<CudaStream>,
        layout: &KvLayout,
        g1: &CudaSlice<u8>,
        g1_blocks: usize,
        blocks: &[(usize, u64)],
        out: &mut CudaSlice<u32>,
    ) -> Result<(), GpuError> {
        let (pieces, piece_len) = g1_geometry(layout, g1.len(), g1_blocks)?;
        if out.len() < blocks.len() {
            return Err(outside(blocks.len(), "out", 4 * out.len(), 4, 4 * out.len()).into());
        }
        let lists = seq_lists(layout, g1.len(), g1_blocks, blocks)?;
        let (g1_ptr, _g) = g1.device_ptr(stream);
        let (out_ptr, _o) = out.device_ptr_mut(stream);
        let g1_blocks = g1_blocks as u64;
        for (i, list) in lists.iter().enumerate() {
            let results = out_ptr + (4 * i * SEQ_MAX_BLOCKS) as u64;
            let mut launch = stream.launch_builder(&self.verify_blocks);
            launch
                .arg(&g1_ptr)
                .arg(&g1_blocks)
                .arg(&pieces)
                .arg(&piece_len)
                .arg(&results)
                .arg(list);
            // SAFETY: `verify_blocks(u64, u64, u32, u32, u32*, SeqList)`; slots checked as in
            // `fill_slots`, and this launch's results, `list.n` from `results`, lie inside
            // `out` (checked above); both buffers are the caller's to keep until it has run.
            unsafe { launch.launch(launch_config(list.n as usize * pieces as usize)) }?;
        }
        Ok(())
    }

    /// Queues writing each piece's pattern into `buf`.
    pub fn fill(
        &self,
        stream: &Arc<CudaStream>,
        buf: &mut CudaSlice<u8>,
        pieces: &[PatternPiece],
    ) -> Result<(), GpuError> {
        plan::check_pattern(pieces, buf.len(), usize::MAX)?;
        if pieces.is_empty() {
            return Ok(());
        }
        // Written: recorded as a write (see `copy`).
        let (base, _b) = buf.device_ptr_mut(stream);
        let words = stream.clone_htod(&pattern_words(pieces, base))?;
        let n = pieces.len() as u32;
        let mut launch = stream.launch_builder(&self.fill);
        launch.arg(&words).arg(&n);
        // SAFETY: `fill_pieces(const PatternPiece*, u32)`; pieces checked inside `buf`.
        unsafe { launch.launch(launch_config(pieces.len())) }?;
        Ok(())
    }

    /// Per result `0..blocks`, the checksum of its pieces of `buf` (waits for `stream`).
    pub fn checksum(
        &self,
        stream: &Arc<CudaStream>,
        buf: &CudaSlice<u8>,
        pieces: &[PatternPiece],
        blocks: usize,
    ) -> Result<Vec<u64>, GpuError> {
        self.per_block(&self.checksum, stream, buf, pieces, blocks)
    }

    /// Queues the verification of `pieces` of `buf`: `out[b]` gains, per result `b`, how
    /// many words of its pieces differ from their pattern (`out` zeroed by the caller).
    pub fn queue_verify(
        &self,
        stream: &Arc<CudaStream>,
        buf: &CudaSlice<u8>,
        pieces: &[PatternPiece],
        out: &mut CudaSlice<u32>,
    ) -> Result<(), GpuError> {
        self.launch_per_block(&self.verify, stream, buf, pieces, out)
    }

    /// Per result `0..blocks`, how many words of its pieces differ from their pattern.
    pub fn verify(
        &self,
        stream: &Arc<CudaStream>,
        buf: &CudaSlice<u8>,
        pieces: &[PatternPiece],
        blocks: usize,
    ) -> Result<Vec<u32>, GpuError> {
        self.per_block(&self.verify, stream, buf, pieces, blocks)
    }

    /// Runs a `(const PatternPiece*, u32, T*)` kernel that adds each piece's figure into
    /// `out[piece.block]`, and reads the `blocks` results back.
    fn per_block<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        kernel: &CudaFunction,
        stream: &Arc<CudaStream>,
        buf: &CudaSlice<u8>,
        pieces: &[PatternPiece],
        blocks: usize,
    ) -> Result<Vec<T>, GpuError> {
        plan::check_pattern(pieces, buf.len(), blocks)?;
        let mut out = stream.alloc_zeros::<T>(blocks.max(1))?;
        self.launch_per_block(kernel, stream, buf, pieces, &mut out)?;
        let mut results = stream.clone_dtoh(&out)?;
        results.truncate(blocks);
        Ok(results)
    }

    /// Queues a per-block kernel over `pieces` of `buf` into `out` (no wait).
    fn launch_per_block<T: DeviceRepr>(
        &self,
        kernel: &CudaFunction,
        stream: &Arc<CudaStream>,
        buf: &CudaSlice<u8>,
        pieces: &[PatternPiece],
        out: &mut CudaSlice<T>,
    ) -> Result<(), GpuError> {
        plan::check_pattern(pieces, buf.len(), out.len())?;
        if pieces.is_empty() {
            return Ok(());
        }
        let (base, _b) = buf.device_ptr(stream);
        let words = stream.clone_htod(&pattern_words(pieces, base))?;
        let n = pieces.len() as u32;
        let mut launch = stream.launch_builder(kernel);
        launch.arg(&words).arg(&n).arg(out);
        // SAFETY: `checksum_pieces` / `verify_pieces(const PatternPiece*, u32, T*)` with T
        // their result type; pieces checked inside `buf`, every `block` below the length of
        // `out`.
        unsafe { launch.launch(launch_config(pieces.len())) }?;
        Ok(())
    }
}

/// A worker's KV bytes on a GPU: G1 in device memory in the paged layout, G2 in pinned host
/// memory, a device staging area for transfers in lanes, and three streams: `main` fills
/// blocks (the engine's), `copies` runs the PCIe copies and `movers` the gathers, scatters
/// and verifications.
///
/// A transfer moves lane by lane: while the copy engine moves one lane over PCIe, `movers`
/// gathers (or scatters) the next, so the device-side work hides behind the link except for
/// the first lane's. The streams are ordered by explicit events (cudarc's per-buffer event
/// tracking is off for this context: it orders a whole buffer, so every fill of G1 would wait
/// for the last gather of an offload in flight):
/// - a transfer's first gather or scatter waits for the work `main` had queued (its fills);
/// - a lane is written (gather on `movers`, H2D on `copies`) only after its `free` event,
///   recorded behind its last reader (D2H on `copies`, scatter on `movers`), and read only
///   after its `ready` event, recorded behind the write;
/// - an onboard's `done` is recorded on `movers` behind its last scatter (and verification),
///   and `main` waits for it before its next work; an offload's `done` is recorded on
///   `copies` behind its last D2H, each of which waited for its gather;
/// - slots themselves (G1 and G2) are the caller's to keep: the worker's block manager holds
///   a transfer's slots until its `done` is seen.
pub struct GpuKv {
    gpu: Gpu,
    layout: KvLayout,
    g1_blocks: usize,
    main: Arc<CudaStream>,
    copies: Arc<CudaStream>,
    movers: Arc<CudaStream>,
    g1: CudaSlice<u8>,
    lanes: Vec<Lane>,
    lane_blocks: usize,
    /// The lane the next transfer starts with (transfers take lanes round robin).
    next_lane: usize,
    /// Re-recorded on `main` by each transfer, for `movers` to wait on.
    main_mark: CudaEvent,
    g2: PinnedHostSlice<u8>,
    /// Pinned buffers for verification results, free for the next checked onboard.
    results: Vec<PinnedHostSlice<u32>>,
}

impl std::fmt::Debug for GpuKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuKv")
            .field("device", &self.gpu.name)
            .field("layout", &self.layout)
            .field("g1_blocks", &self.g1_blocks)
            .field(
                "g2_blocks",
                &(self.g2.len() / self.layout.block_bytes().max(1)),
            )
            .finish()
    }
}

/// One lane of the staging area: `lane_blocks` packed blocks and the events ordering its
/// writer and reader streams (see [`GpuKv`]).
struct Lane {
    buf: CudaSlice<u8>,
    /// Recorded behind the lane's last write (gather or H2D).
    ready: CudaEvent,
    /// Recorded behind the lane's last read (D2H or scatter).
    free: CudaEvent,
}

/// A queued transfer: poll it with [`GpuKv::is_done`] and end it with [`GpuKv::finish`]
/// (or block on [`Transfer::wait`]).
#[derive(Debug)]
pub struct Transfer {
    done: CudaEvent,
    check: Option<Check>,
}

/// An onboard's verification: mismatching words per block, counted on the device after the
/// scatter and copied into pinned host memory before the transfer's event.
#[derive(Debug)]
struct Check {
    /// Read by the copy into `host`; freed once the transfer is done.
    _device: CudaSlice<u32>,
    host: PinnedHostSlice<u32>,
    blocks: usize,
}

impl Transfer {
    /// Waits for the copy to finish.
    pub fn wait(&self) -> Result<(), GpuError> {
        Ok(self.done.synchronize()?)
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        // A verification's copy may still be writing into its pinned buffer: wait for it
        // before that buffer is freed (only a transfer dropped unfinished ever waits here).
        if self.check.is_some() {
            let _ = self.done.synchronize();
        }
    }
}

impl GpuKv {
    /// Allocates G1 (`g1_blocks`) on device `ordinal`, G2 (`g2_blocks`) in pinned host memory
    /// and a staging area of `staging_blocks` blocks.
    pub fn new(
        ordinal: usize,
        layout: KvLayout,
        g1_blocks: usize,
        g2_blocks: usize,
        staging_blocks: usize,
    ) -> Result<GpuKv, GpuError> {
        let gpu = Gpu::new(ordinal)?;
        // SAFETY: every buffer of this context is created below and ordered across streams by
        // the events the type's docs list; all streams are synchronised before anything is
        // freed (`Drop`), and each buffer is used only after the synchronisation below.
        unsafe { gpu.ctx.disable_event_tracking() };
        let main = gpu.stream()?;
        let copies = gpu.stream()?;
        let movers = gpu.stream()?;
        let block = layout.block_bytes();
        let g1 = gpu.alloc(&main, g1_blocks * block)?;
        let staging_blocks = staging_blocks.max(1);
        let lane_blocks = (LANE_BYTES / block.max(1))
            .clamp(1, MOVE_MAX_BLOCKS)
            .min(staging_blocks);
        let lanes = (0..staging_blocks / lane_blocks)
            .map(|_| {
                Ok(Lane {
                    buf: gpu.alloc(&movers, lane_blocks * block)?,
                    ready: gpu.ctx.new_event(None)?,
                    free: gpu.ctx.new_event(None)?,
                })
            })
            .collect::<Result<Vec<_>, GpuError>>()?;
        let main_mark = gpu.ctx.new_event(None)?;
        // SAFETY: zeroed below before any use. Flags 0: plain page-locked memory (not
        // write-combined: the host reads G2 back when verifying).
        let mut g2 = unsafe {
            gpu.ctx
                .alloc_pinned_with_flags::<u8>((g2_blocks * block).max(1), 0)
        }?;
        g2.as_mut_slice()?.fill(0);
        main.synchronize()?;
        copies.synchronize()?;
        movers.synchronize()?;
        Ok(GpuKv {
            gpu,
            layout,
            g1_blocks,
            main,
            copies,
            movers,
            g1,
            lanes,
            lane_blocks,
            next_lane: 0,
            main_mark,
            g2,
            results: Vec::new(),
        })
    }

    /// The device's name and compute capability. (Not the device itself: its context has
    /// cudarc's event tracking off, see [`GpuKv`], which `Gpu`'s safe methods rely on, so a
    /// buffer allocated through it and used on another stream was a use after free.)
    pub fn device(&self) -> (&str, (i32, i32)) {
        (&self.gpu.name, self.gpu.arch)
    }

    /// The geometry.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Queues writing the pattern of `seq` into each G1 slot (prefill's KV writes).
    /// Uploads nothing: the slots travel in the launches' parameters ([`Gpu::fill_slots`]).
    pub fn fill(&mut self, blocks: &[(usize, u64)]) -> Result<(), GpuError> {
        self.gpu.fill_slots(
            &self.main,
            &self.layout,
            &mut self.g1,
            self.g1_blocks,
            blocks,
        )
    }

    /// [`GpuKv::fill`] as it was before slot lists: the blocks' piece list (2 × layers
    /// descriptors a block) uploaded from pageable memory for `fill_pieces`, on the same
    /// stream. Kept for `kvroute-bench kernels` to time the two side by side.
    pub fn fill_by_pieces(&mut self, blocks: &[(usize, u64)]) -> Result<(), GpuError> {
        let pieces = plan::g1_blocks(&self.layout, self.g1_blocks, blocks);
        self.gpu.fill(&self.main, &mut self.g1, &pieces)
    }

    /// Mismatching words per G1 slot against the pattern of its `seq` (waits).
    pub fn verify_g1(&self, blocks: &[(usize, u64)]) -> Result<Vec<u32>, GpuError> {
        let mut out = self.main.alloc_zeros::<u32>(blocks.len().max(1))?;
        self.gpu.queue_verify_slots(
            &self.main,
            &self.layout,
            &self.g1,
            self.g1_blocks,
            blocks,
            &mut out,
        )?;
        let mut bad = self.main.clone_dtoh(&out)?;
        bad.truncate(blocks.len());
        Ok(bad)
    }

    /// Checksums of G1 slots (waits).
    pub fn checksum_g1(&self, slots: &[usize]) -> Result<Vec<u64>, GpuError> {
        let blocks: Vec<(usize, u64)> = slots.iter().map(|&s| (s, 0)).collect();
        let pieces = plan::g1_blocks(&self.layout, self.g1_blocks, &blocks);
        self.gpu
            .checksum(&self.main, &self.g1, &pieces, blocks.len())
    }

    /// Checksums of G2 slots, computed on the host (waits for queued copies).
    pub fn checksum_g2(&self, slots: &[usize]) -> Result<Vec<u64>, GpuError> {
        self.copies.synchronize()?;
        let blocks: Vec<(usize, u64)> = slots.iter().map(|&s| (s, 0)).collect();
        let pieces = plan::packed_blocks(&self.layout, &blocks);
        Ok(reference::checksum(
            self.g2.as_slice()?,
            &pieces,
            blocks.len(),
        )?)
    }

    fn check_slots(&self, g1: usize, g2: usize) -> Result<(), GpuError> {
        let block = self.layout.block_bytes();
        let g2_blocks = self.g2.len() / block.max(1);
        if g1 >= self.g1_blocks || g2 >= g2_blocks {
            return Err(PieceError {
                index: 0,
                buffer: if g1 >= self.g1_blocks { "g1" } else { "g2" },
                start: (g1.max(g2) * block) as u64,
                end: ((g1.max(g2) + 1) * block) as u64,
                len: if g1 >= self.g1_blocks {
                    self.g1.len()
                } else {
                    self.g2.len()
                },
            }
            .into());
        }
        Ok(())
    }

    /// Makes `movers` wait for the work `main` has queued so far.
    fn after_main(&self) -> Result<(), GpuError> {
        self.main_mark.record(&self.main)?;
        self.movers.wait(&self.main_mark)?;
        Ok(())
    }

    /// The lane for the next `lane_blocks` of a transfer.
    fn take_lane(&mut self) -> usize {
        let lane = self.next_lane;
        self.next_lane = (lane + 1) % self.lanes.len();
        lane
    }

    /// Queues offload of `(g1, g2)` slot pairs, lane by lane: gather into the lane on
    /// `movers`, then D2H into pinned G2 on `copies`, after what `main` has queued so far
    /// (the blocks' fills).
    pub fn offload(&mut self, pairs: &[(usize, usize)]) -> Result<Transfer, GpuError> {
        for &(g1, g2) in pairs {
            self.check_slots(g1, g2)?;
        }
        let queued = self.queue_offload(pairs);
        self.settled(queued)
    }

    /// A transfer that failed part-way may have queued copies that touch its slots: wait for
    /// them, so that the caller may reuse the slots at once (a driver error is rare, and the
    /// worker stops its engine on one).
    fn settled(&self, queued: Result<Transfer, GpuError>) -> Result<Transfer, GpuError> {
        if queued.is_err() {
            let _ = self.synchronize();
        }
        queued
    }

    fn queue_offload(&mut self, pairs: &[(usize, usize)]) -> Result<Transfer, GpuError> {
        self.after_main()?;
        let block = self.layout.block_bytes();
        for chunk in pairs.chunks(self.lane_blocks) {
            let i = self.take_lane();
            let lane = &mut self.lanes[i];
            self.movers.wait(&lane.free)?;
            let slots: Vec<usize> = chunk.iter().map(|&(g1, _)| g1).collect();
            self.gpu.gather(
                &self.movers,
                &self.layout,
                &self.g1,
                self.g1_blocks,
                &slots,
                &mut lane.buf,
            )?;
            lane.ready.record(&self.movers)?;
            self.copies.wait(&lane.ready)?;
            let (staged, _s) = lane.buf.device_ptr(&self.copies);
            let host = self.g2.as_mut_slice()?;
            for (first_j, first_g2, len) in runs(chunk.iter().map(|&(_, g2)| g2)) {
                let dst = &mut host[first_g2 * block..(first_g2 + len) * block];
                // SAFETY: `dst` is inside pinned G2 (slots checked above), the source run
                // inside the lane (`first_j + len <= lane_blocks`); both stay allocated
                // until the copy stream is synchronised (on drop of `self` at the latest).
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(
                        dst,
                        staged + (first_j * block) as u64,
                        self.copies.cu_stream(),
                    )
                }?;
            }
            lane.free.record(&self.copies)?;
        }
        Ok(Transfer {
            done: self.copies.record_event(None)?,
            check: None,
        })
    }

    /// Queues onboard of `(g2, g1)` slot pairs, lane by lane: H2D from pinned G2 into the
    /// lane on `copies`, then scatter into G1 on `movers`; `main` waits for it before its
    /// next work.
    pub fn onboard(&mut self, pairs: &[(usize, usize)]) -> Result<Transfer, GpuError> {
        self.queue_onboard(pairs, None)
    }

    /// [`GpuKv::onboard`], then on the same stream the verification of each block against
    /// the pattern of its `seqs[i]`: [`GpuKv::finish`] gives the mismatching words per pair.
    pub fn onboard_checked(
        &mut self,
        pairs: &[(usize, usize)],
        seqs: &[u64],
    ) -> Result<Transfer, GpuError> {
        assert_eq!(pairs.len(), seqs.len(), "one hash per onboarded block");
        self.queue_onboard(pairs, Some(seqs))
    }

    fn queue_onboard(
        &mut self,
        pairs: &[(usize, usize)],
        seqs: Option<&[u64]>,
    ) -> Result<Transfer, GpuError> {
        for &(g2, g1) in pairs {
            self.check_slots(g1, g2)?;
        }
        let queued = self.queue_onboard_lanes(pairs, seqs);
        self.settled(queued)
    }

    fn queue_onboard_lanes(
        &mut self,
        pairs: &[(usize, usize)],
        seqs: Option<&[u64]>,
    ) -> Result<Transfer, GpuError> {
        self.after_main()?;
        if let Some(seqs) = seqs {
            // Before the scatter, on its stream: G1 slots hold a pattern the check refuses,
            // so that a slot freed by the same block's eviction (its bytes still there) and
            // a copy lost on the way fails the check instead of passing it.
            let poison: Vec<(usize, u64)> = pairs
                .iter()
                .zip(seqs)
                .map(|(&(_, g1), &seq)| (g1, !seq))
                .collect();
            self.gpu.fill_slots(
                &self.movers,
                &self.layout,
                &mut self.g1,
                self.g1_blocks,
                &poison,
            )?;
        }
        let block = self.layout.block_bytes();
        for chunk in pairs.chunks(self.lane_blocks) {
            let i = self.take_lane();
            let lane = &mut self.lanes[i];
            self.copies.wait(&lane.free)?;
            {
                let (staged, _s) = lane.buf.device_ptr(&self.copies);
                let host = self.g2.as_slice()?;
                for (first_j, first_g2, len) in runs(chunk.iter().map(|&(g2, _)| g2)) {
                    let src = &host[first_g2 * block..(first_g2 + len) * block];
                    // SAFETY: as in `offload`, in the other direction.
                    unsafe {
                        cudarc::driver::result::memcpy_htod_async(
                            staged + (first_j * block) as u64,
                            src,
                            self.copies.cu_stream(),
                        )
                    }?;
                }
            }
            lane.ready.record(&self.copies)?;
            self.movers.wait(&lane.ready)?;
            let slots: Vec<usize> = chunk.iter().map(|&(_, g1)| g1).collect();
            self.gpu.scatter(
                &self.movers,
                &self.layout,
                &lane.buf,
                &slots,
                &mut self.g1,
                self.g1_blocks,
            )?;
            lane.free.record(&self.movers)?;
        }
        let check = match seqs {
            Some(seqs) => Some(self.queue_check(pairs, seqs)?),
            None => None,
        };
        let done = self
            .movers
            .record_event(None)
            .and_then(|done| self.main.wait(&done).map(|()| done));
        match done {
            Ok(done) => Ok(Transfer { done, check }),
            Err(e) => {
                // The verification's copy may still be writing into its pinned buffer,
                // which `check` frees: only a `Transfer` waits for it when dropped.
                if check.is_some() {
                    let _ = self.movers.synchronize();
                }
                Err(e.into())
            }
        }
    }

    /// Queues the verification of the onboarded G1 slots on `movers` and the copy of its
    /// results into a pooled pinned buffer.
    fn queue_check(&mut self, pairs: &[(usize, usize)], seqs: &[u64]) -> Result<Check, GpuError> {
        let blocks: Vec<(usize, u64)> = pairs
            .iter()
            .zip(seqs)
            .map(|(&(_, g1), &seq)| (g1, seq))
            .collect();
        let n = blocks.len();
        let mut device = self.movers.alloc_zeros::<u32>(n.max(1))?;
        self.gpu.queue_verify_slots(
            &self.movers,
            &self.layout,
            &self.g1,
            self.g1_blocks,
            &blocks,
            &mut device,
        )?;
        let mut host = match self.results.iter().position(|b| b.len() >= n.max(1)) {
            Some(i) => self.results.swap_remove(i),
            // SAFETY: uninitialised pinned memory; only the first `n` values are read, after
            // the copy below has written them.
            None => unsafe {
                self.gpu
                    .ctx
                    .alloc_pinned_with_flags::<u32>(n.max(64).next_power_of_two(), 0)
            }?,
        };
        {
            let (src, _d) = device.device_ptr(&self.movers);
            let dst = &mut host.as_mut_slice()?[..n.max(1)];
            // SAFETY: `dst` is pinned and owned by the returned `Check`, `src` by its
            // `_device`; both live until the transfer's event has been seen done.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(dst, src, self.movers.cu_stream())
            }?;
        }
        Ok(Check {
            _device: device,
            host,
            blocks: n,
        })
    }

    /// Whether `transfer` has finished, without waiting (an event query). An error is the
    /// device's, for this copy or an earlier asynchronous failure.
    pub fn is_done(&self, transfer: &Transfer) -> Result<bool, GpuError> {
        self.gpu.ctx.bind_to_thread()?;
        Ok(transfer.done.try_is_complete()?)
    }

    /// Ends `transfer` (waiting if [`GpuKv::is_done`] has not said so): for a checked
    /// onboard, the mismatching words per pair; empty otherwise.
    pub fn finish(&mut self, mut transfer: Transfer) -> Result<Vec<u32>, GpuError> {
        transfer.wait()?;
        let Some(check) = transfer.check.take() else {
            return Ok(Vec::new());
        };
        let bad = check.host.as_slice()?[..check.blocks].to_vec();
        self.results.push(check.host);
        Ok(bad)
    }

    /// Queues one contiguous copy of the first `bytes` of G1 to the start of G2 (`to_host`)
    /// or back: the baseline the benchmark compares gather+D2H and H2D+scatter with.
    pub fn contiguous_copy(&mut self, to_host: bool, bytes: usize) -> Result<Transfer, GpuError> {
        let bytes = bytes.min(self.g1.len()).min(self.g2.len());
        self.main_mark.record(&self.main)?;
        self.copies.wait(&self.main_mark)?;
        let (g1, _g) = self.g1.device_ptr(&self.copies);
        // SAFETY: both ranges are within their buffers (clamped above), which live until the
        // copy stream is synchronised.
        unsafe {
            if to_host {
                let host = &mut self.g2.as_mut_slice()?[..bytes];
                cudarc::driver::result::memcpy_dtoh_async(host, g1, self.copies.cu_stream())?;
            } else {
                let host = &self.g2.as_slice()?[..bytes];
                cudarc::driver::result::memcpy_htod_async(g1, host, self.copies.cu_stream())?;
            }
        }
        // `main`'s later work (fills) writes G1: after this copy has read or written it.
        let done = self.copies.record_event(None)?;
        self.main.wait(&done)?;
        Ok(Transfer { done, check: None })
    }

    /// Waits for everything queued.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.main.synchronize()?;
        self.copies.synchronize()?;
        self.movers.synchronize()?;
        Ok(())
    }
}

impl Drop for GpuKv {
    fn drop(&mut self) {
        // Queued copies read and write G2 and staging: finish them before freeing.
        let _ = self.synchronize();
    }
}

/// Runs of consecutive slots: `(position of the first in the list, first slot, length)`.
fn runs(slots: impl Iterator<Item = usize>) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for (j, slot) in slots.enumerate() {
        match out.last_mut() {
            Some((first_j, first, len)) if *first + *len == slot && *first_j + *len == j => {
                *len += 1;
            }
            _ => out.push((j, slot, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_join_consecutive_slots_only() {
        assert_eq!(
            runs([4, 5, 6, 9, 10, 2].into_iter()),
            vec![(0, 4, 3), (3, 9, 2), (5, 2, 1)]
        );
        assert!(runs(std::iter::empty()).is_empty());
    }

    #[test]
    fn descriptors_match_the_c_structs() {
        let p = Piece {
            src: 8,
            dst: 16,
            len: 24,
        };
        assert_eq!(copy_words(&[p], 1000, 2000), vec![1008, 2016, 24]);
        let q = PatternPiece {
            addr: 4,
            seq: 7,
            piece: 3,
            len: 10,
            block: 2,
        };
        assert_eq!(pattern_words(&[q], 100), vec![104, 7, 3 | (10 << 32), 2]);
    }

    #[test]
    fn without_a_driver_new_is_an_error_not_a_panic() {
        // On a GPU machine this opens device 0; elsewhere it must say what is missing.
        match Gpu::new(0) {
            Ok(gpu) => assert!(gpu.arch.0 >= 5),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
        assert!(Gpu::new(10_000).is_err());
    }
}
