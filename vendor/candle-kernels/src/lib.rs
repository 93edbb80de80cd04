mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Id {
    Affine,
    Binary,
    Cast,
    Conv,
    Fill,
    Indexing,
    Quantized,
    Reduce,
    Sort,
    Ternary,
    Unary,
}

pub const ALL_IDS: [Id; 11] = [
    Id::Affine,
    Id::Binary,
    Id::Cast,
    Id::Conv,
    Id::Fill,
    Id::Indexing,
    Id::Quantized,
    Id::Reduce,
    Id::Sort,
    Id::Ternary,
    Id::Unary,
];

pub struct Module {
    index: usize,
    ptx: &'static str,
    image: Option<&'static [u8]>,
}

impl Module {
    pub fn index(&self) -> usize {
        self.index
    }

    pub fn ptx(&self) -> &'static str {
        self.ptx
    }

    /// The module as a fat binary with machine code (vidgen's patch), where one was built.
    pub fn image(&self) -> Option<&'static [u8]> {
        self.image
    }
}

const fn module_index(id: Id) -> usize {
    let mut i = 0;
    while i < ALL_IDS.len() {
        if ALL_IDS[i] as u32 == id as u32 {
            return i;
        }
        i += 1;
    }
    panic!("id not found")
}

macro_rules! mdl {
    ($cst:ident, $id:ident) => {
        pub const $cst: Module = Module {
            index: module_index(Id::$id),
            ptx: ptx::$cst,
            image: None,
        };
    };
    ($cst:ident, $id:ident, $image:literal) => {
        pub const $cst: Module = Module {
            index: module_index(Id::$id),
            ptx: ptx::$cst,
            // A reference to one static array: the machine code once in the binary, however
            // many crates use the constant (a reference to the bytes themselves is copied into
            // each).
            image: Some({
                static IMAGE: [u8; include_bytes!(concat!(env!("OUT_DIR"), "/", $image)).len()] =
                    *include_bytes!(concat!(env!("OUT_DIR"), "/", $image));
                &IMAGE
            }),
        };
    };
}

mdl!(AFFINE, Affine, "affine.fatbin");
mdl!(BINARY, Binary, "binary.fatbin");
mdl!(CAST, Cast, "cast.fatbin");
mdl!(CONV, Conv, "conv.fatbin");
mdl!(FILL, Fill, "fill.fatbin");
mdl!(INDEXING, Indexing, "indexing.fatbin");
mdl!(QUANTIZED, Quantized);
mdl!(REDUCE, Reduce, "reduce.fatbin");
mdl!(SORT, Sort);
mdl!(TERNARY, Ternary, "ternary.fatbin");
mdl!(UNARY, Unary, "unary.fatbin");

pub mod ffi;
