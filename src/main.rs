fn main() {
    println!("vidgen");
}
