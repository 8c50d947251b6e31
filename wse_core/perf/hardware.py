"""The emulated hardware's constants: one ``Hardware`` value, WSE-2 / CS-2 cluster defaults, and the
CS-3 (``SYSTEMS``: ``runconfig.hardware: cs3``, or ``{system: cs3, ...}`` with overrides).

Every constant says where it comes from: a public Cerebras document (the seeds of this project,
``../shared/seeds``), the Cerebras SDK's conventions, or **assumption** where nothing public gives
the figure. Any constant can be overridden from the params (``runconfig.hardware: {io_gbps: 600}``)
or in Python (``Hardware(io_gbps=600)``); the model is only as good as these numbers, and says so.
The precision is no constant of the hardware but the model's (``model.mixed_precision``): a run's
``Hardware`` takes it from the model (``Hardware.for_model``). See docs/design/time-model.md "Hardware".
"""
from dataclasses import asdict, dataclass, fields, replace

from wse_core.checks import Number, OneOf
from wse_core.errors import ConfigError

#: The systems a run may name, as the constants in which each differs from the CS-2 defaults of
#: ``Hardware`` (docs/design/time-model.md "Systems"). The CS-3 (WSE-3), with its sources:
#: - 900,000 cores: Cerebras' WSE-3 datasheet; Argonne's CS system tutorial (SC24).
#: - program rectangle 755 x 1170 PEs: the Cerebras SDK's examples compile for the CS-3 with
#:   ``--arch=wse3 --fabric-dims=762,1172 --fabric-offsets=4,1``, and the program rectangle leaves
#:   the columns and rows the WSE-2's 757 x 996 fabric leaves around its 750 x 994 (7 and 2: the
#:   SDK's simulator examples size a P x P program's fabric P + 7 by P + 2). 883,350 PEs, 18.5%
#:   more than the WSE-2's 745,500: Cerebras' cluster docs say the CS-3 "expands the core count by
#:   20%" (docs.cerebras.ai, "How Cerebras works").
#: - I/O 1,560 Gb/s: the same docs, "enhances the ingress/egress bandwidth by 30%" (1.3 x 1.2 Tb/s);
#:   MemoryX's link follows it (the CS-2's **assumption**: never the narrower end of the stream).
#: - 8 fp16 lanes: the same docs say the CS-3 "boosts the SIMD width"; The Next Platform (2024-03-14,
#:   "Cerebras Goes Hyperscale With Third Gen Waferscale Supercomputers") reports an "eight-wide
#:   FP16 SIMD math unit, up from a four-wide SIMD engine used in the WSE-1 and WSE-2".
#: - SRAM per PE: 44 GB over 900,000 cores is 48.9 KB each (Cerebras: 44 GB "spread evenly");
#:   **assumption**: 48 KiB, the WSE-2's, unchanged. Clock: **assumption**: the CS-2's 850 MHz.
SYSTEMS = {
    "cs2": {},
    "cs3": {"pes": 900_000, "program_width": 755, "program_height": 1170, "io_gbps": 1560.0,
            "memoryx_gbps": 1560.0, "fmac_lanes_fp16": 8},
}


@dataclass(frozen=True)
class Hardware:
    #: The system these constants describe (``SYSTEMS``): its constants are the defaults, the
    #: params' overrides apply over them.
    system: str = "cs2"
    # -- the wafer (WSE-2) ---------------------------------------------------------------------
    #: Processing elements of a WSE-2. Source: Cerebras system overview ("850,000 cores"), seed 003.
    pes: int = 850_000
    #: The rectangle a program may use, width x height PEs: the Cerebras SDK's usable WSE-2
    #: program rectangle (750 x 994 of the 757 x 996 fabric). The compute model maps GEMMs onto it.
    program_width: int = 750
    program_height: int = 994
    #: SRAM per PE, bytes. Source: seed 003 ("48 KB of SRAM" per core).
    pe_memory_bytes: int = 48 * 1024
    #: Fraction of a PE's SRAM a program's tensors may use (a pipelined layer's, a streamed
    #: micro-batch's activations and weights in flight); the rest holds its code, fabric buffers and
    #: stack. **Assumption**: no public figure; 3/4.
    pe_memory_usable: float = 0.75
    #: Clock, Hz: the factor the Cerebras SDK uses to turn PE cycles into seconds (docs/design/time-model.md
    #: "Hardware"; Cerebras' csl-examples: "a PE runs with clock speed 850MHz"). Cerebras publishes no
    #: clock of a running CS-2 (its 7.5 PF would need about 1.1 GHz at 4 fp16 lanes).
    clock_hz: float = 850e6
    #: Multiply-adds per PE per cycle, fp16 and fp32 (docs/design/time-model.md "Hardware": 4-wide fp16, 1-wide fp32
    #: FMAC, the SDK's SIMD widths). The fabric
    #: simulator, which calibrates the compute model, runs fp32 one lane wide; fp16 divides the FMAC
    #: term of the calibrated formula by 4 (**assumption**: the rest of the formula is unchanged).
    fmac_lanes_fp16: int = 4
    fmac_lanes_fp32: int = 1
    #: Values per 32-bit fabric wavelet: 2 fp16 or 1 fp32 (wavelets carry 32 bits of data).
    values_per_wavelet_fp16: int = 2
    values_per_wavelet_fp32: int = 1
    #: Precision of weights and activations on the wafer: "fp16" (any 16-bit format) or "fp32".
    #: Sets lanes, wavelet packing and stream bytes. The model's, not a constant: ``for_model``
    #: sets it from model.mixed_precision and the params may not (a second spelling let a float32
    #: run be timed at 2 bytes a value). The default is mixed precision, as Cerebras trains.
    precision: str = "fp16"
    # -- a CS-2 system ---------------------------------------------------------------------------
    #: I/O bandwidth of one CS-2 into and out of the wafer, Gb/s each way. Source: the CS-2's
    #: published 12 x 100 GbE system I/O (1.2 Tb/s), as docs/design/time-model.md "Hardware" cites it.
    io_gbps: float = 1200.0
    # -- SwarmX ---------------------------------------------------------------------------------
    #: Bandwidth of one SwarmX port, Gb/s: 100 GbE, as docs/design/time-model.md "Hardware" cites it (seeds 002 and
    #: 004 describe SwarmX as the broadcast/reduce network, without port speeds).
    swarmx_port_gbps: float = 100.0
    #: Ports between one SwarmX node and one child (a CS-2 or a lower node): a child gets the
    #: full CS-2 I/O rate when its link bundles io_gbps / swarmx_port_gbps ports (**assumption**:
    #: the tree is built so every CS-2 can stream at its I/O rate).
    swarmx_ports_per_child: int = 12
    #: Fan-out of a SwarmX broadcast/reduce node (one 1:4, or two 1:2). Source: Cerebras' public
    #: descriptions of SwarmX as docs/design/time-model.md "Hardware" cites them (not in the seeds). A run's tree
    #: takes its fan-out from runconfig.swarmx_fanout; this is the scaling model's default.
    swarmx_fanout: int = 4
    #: Latency a wavelet of data takes through one SwarmX node (store, reduce, forward), seconds.
    #: **Assumption** (no public figure): 2 us, a switch hop plus a reduce at line rate.
    swarmx_hop_latency_s: float = 2e-6
    # -- MemoryX --------------------------------------------------------------------------------
    #: Bytes of weights and optimizer state one MemoryX holds. Source: Cerebras quotes MemoryX
    #: configurations from 4 TB up to 2.4 PB; 4 TB is the smallest.
    memoryx_bytes: float = 4e12
    #: Rate at which MemoryX applies the optimizer update, bytes of weights per second.
    #: **Assumption**: no public figure. 100 GB/s: a few CPU servers' memory bandwidth, each
    #: AdamW update touching about 7 words per weight (this project's fused kernel measures it).
    memoryx_update_bytes_per_s: float = 100e9
    #: Bandwidth between MemoryX and the root of the SwarmX tree, Gb/s. **Assumption**: as fast
    #: as one CS-2's I/O, so MemoryX is never the narrower end of the stream.
    memoryx_gbps: float = 1200.0

    def __post_init__(self):
        for f in fields(self):  # the one validator (wse_core.checks)
            if f.name == "precision":
                OneOf("fp16", "fp32")(self.precision, "Hardware.precision")
            elif f.name == "system":
                OneOf(*SYSTEMS)(self.system, "runconfig.hardware.system")
            else:
                Number(0, open="low")(getattr(self, f.name), f"runconfig.hardware.{f.name}")

    @classmethod
    def from_params(cls, overrides=None, *, precision="fp16"):
        """The constants of ``runconfig.hardware`` at ``precision``: a system's name ("cs2", "cs3"), or
        a mapping of constants over the defaults of its ``system`` (default cs2); a key that is no
        constant, or ``precision`` (the model's), is refused naming the key."""
        overrides = overrides or {}
        if isinstance(overrides, str):
            overrides = {"system": overrides}
        if "precision" in overrides:
            raise ConfigError("runconfig.hardware.precision: the precision is the model's "
                              "(model.mixed_precision, model.fp16_type); remove this key")
        known = {f.name for f in fields(cls)} - {"precision"}
        for key in overrides:
            if key not in known:
                raise ConfigError(f"runconfig.hardware.{key}: unknown constant (known: {', '.join(sorted(known))})")
        system = overrides.get("system", "cs2")
        OneOf(*SYSTEMS)(system, "runconfig.hardware.system")
        return replace(cls(precision=precision, system=system, **SYSTEMS[system]), **overrides)

    @classmethod
    def for_model(cls, model, overrides=None):
        """The hardware a run of ``model`` (a ``wse_core.nn`` Model) is timed on: ``runconfig.hardware``
        applied, at the model's precision: fp16 when it streams 16-bit values (model.mixed_precision,
        whatever its fp16_type: float16, bfloat16 and cbfloat16 all take 2 bytes and the 16-bit
        lanes), fp32 otherwise."""
        return cls.from_params(overrides, precision="fp16" if model.precision.itemsize == 2 else "fp32")

    def to_dict(self):
        return asdict(self)

    # -- derived figures ---------------------------------------------------------------------------
    @property
    def bytes_per_value(self):
        return 2 if self.precision == "fp16" else 4

    @property
    def fmac_lanes(self):
        return self.fmac_lanes_fp16 if self.precision == "fp16" else self.fmac_lanes_fp32

    @property
    def values_per_wavelet(self):
        return self.values_per_wavelet_fp16 if self.precision == "fp16" else self.values_per_wavelet_fp32

    @property
    def io_bytes_per_s(self):
        return self.io_gbps * 1e9 / 8

    @property
    def usable_sram_bytes(self):
        """SRAM a program may fill: its rectangle's PEs, each ``pe_memory_usable`` of its memory (what a
        pipelined model and a streamed micro-batch are held against)."""
        return self.program_width * self.program_height * int(self.pe_memory_bytes * self.pe_memory_usable)

    @property
    def peak_flops(self):
        """Multiply-adds of every PE of the program rectangle on every lane, as flops per second."""
        return 2 * self.program_width * self.program_height * self.fmac_lanes * self.clock_hz
