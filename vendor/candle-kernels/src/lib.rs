mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// vidgen's patch: machine code for the modules build.rs builds it for.
mod images {
    include!(concat!(env!("OUT_DIR"), "/images.rs"));
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
    ($cst:ident, $id:ident, image) => {
        pub const $cst: Module = Module {
            index: module_index(Id::$id),
            ptx: ptx::$cst,
            image: Some(images::$cst),
        };
    };
}

mdl!(AFFINE, Affine, image);
mdl!(BINARY, Binary, image);
mdl!(CAST, Cast, image);
mdl!(CONV, Conv, image);
mdl!(FILL, Fill, image);
mdl!(INDEXING, Indexing, image);
mdl!(QUANTIZED, Quantized);
mdl!(REDUCE, Reduce, image);
mdl!(SORT, Sort);
mdl!(TERNARY, Ternary, image);
mdl!(UNARY, Unary, image);

pub mod ffi;
